"""``python -m rllight``: the same command as ``rllight``."""

from rllight.cli import main

if __name__ == "__main__":
    main()
