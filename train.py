#!/usr/bin/env python
"""Train a visattn model from a YAML config: ``python train.py --config configs/smoke.yaml [key=value ...]``."""
import sys

from visattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
