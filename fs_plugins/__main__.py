"""`python -m fs_plugins …` is the `fs-plugins` command."""
from fs_plugins.commands.cli import main

if __name__ == '__main__':
    raise SystemExit(main())
