"""Make the repository root importable (files live flat at the root) and keep tests single-threaded
per rank so the 2-core machine is not oversubscribed."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
