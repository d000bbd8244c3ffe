"""`python -m pagedkv.cli`: the `pagedkv` command."""

import sys

from pagedkv.cli import main

sys.exit(main())
