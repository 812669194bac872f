"""`python -m tandem` is the `tandem` command."""

import sys

from tandem.cli.main import main

sys.exit(main())
