"""tandem's test suite, a package so that its shared helpers import by one full name
(`tests.support.live_server`) wherever a test file sits."""
