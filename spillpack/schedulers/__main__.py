"""`python -m spillpack.schedulers`: rewrite examples/schedulers/ from the templates."""

from spillpack.schedulers.examples import write_examples

for p in write_examples():
    print(p)
