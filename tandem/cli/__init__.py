"""The `tandem` command line: the command table (`main`) and the flag tables every command
builds its parser from (`flags`)."""
