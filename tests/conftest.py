"""Shared test set-up: make tests/ importable (for sim.py) and bound every test."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
