import os
import sys

# handwritten_mods.py lives next to the tests that import it.
sys.path.insert(0, os.path.dirname(__file__))
