"""``python -m k2lab`` is the ``k2lab`` command (torchrun launches modules this way)."""

from k2lab.cli import main

if __name__ == "__main__":
    main()
