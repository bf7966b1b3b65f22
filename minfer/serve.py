"""`python -m minfer.serve`, the OpenAI-compatible server: see minfer/server/serve.py (also `minfer serve`)."""

import sys

from .server.serve import create_server, main  # noqa: F401  (the names older code imports from here)

if __name__ == "__main__":
    sys.exit(main())
