"""``python -m torchmn run -np N COMMAND``: the same as the ``torchmn`` console script."""
import sys

from torchmn.cli import main

if __name__ == "__main__":
    sys.exit(main())
