"""``python -m bench.distkv [--profile quick|full] [--out DIR]``: see experiment.py."""

import sys

from bench.distkv.experiment import main

sys.exit(main())
