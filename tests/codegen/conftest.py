import os
import sys

# codegen_cases.py lives next to the tests that import it.
sys.path.insert(0, os.path.dirname(__file__))
