"""`python -m rollouts.tinker_server ...` = `rollouts tinker-serve ...`."""

import sys

from rollouts.tinker_server.serve import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m rollouts.tinker_server"))
