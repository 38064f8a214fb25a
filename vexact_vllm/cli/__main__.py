import sys

from . import main

if __name__ == "__main__":  # vLLM may spawn engine processes, which re-import the main module
    sys.exit(main())
