import os
import sys

# handwritten_mods.py and the PTX helpers live next to the tests that import them; the GPU probe scripts whose
# harnesses these tests check live in benchmarks/probes.
HERE = os.path.dirname(os.path.abspath(__file__))
PROBES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "probes")
sys.path.insert(0, HERE)
sys.path.insert(1, PROBES)
