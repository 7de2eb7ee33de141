"""``python -m k2lab`` is the ``k2lab`` command (torchrun launches modules this way)."""

from k2lab.cli import main
from k2lab.train.distributed import exit_without_teardown

if __name__ == "__main__":
    with exit_without_teardown():  # a no-op unless this process ran distributed training
        main()
