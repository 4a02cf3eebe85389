"""The command line, ``memfit`` / ``python -m memfit``: an argparse root (``main``) and one
module per subcommand (demo, profile, plan, sweep, verify). It holds no logic the Python API
lacks: each subcommand parses, calls the library and prints.
"""
