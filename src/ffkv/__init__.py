import os as _os

# Bit-identical floats across processes: without MKL's conditional numerical reproducibility
# a fresh process sometimes rounds the same batch a few ulps differently, so a resumed or
# Ray-sharded mine would not equal an uninterrupted one. Set before torch loads MKL; a
# user's own MKL_CBWR wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
