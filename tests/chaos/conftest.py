"""tests/chaos: the shared leak check lives one directory up (tests/leaks.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
