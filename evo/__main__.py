import gc
import sys

from evo.cli import main

code = main()
# The work is done: the interpreter's last garbage collections at exit walk every object torch, MLflow and
# plotting imported (seconds on a 2-core machine); frozen objects are left out of them. Exit handlers still run.
gc.freeze()
sys.exit(code)
