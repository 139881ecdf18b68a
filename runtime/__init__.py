"""spillpack's runtime: everything the bundle's zipapp carries.

It never imports the `spillpack` package (the laptop side), so a bundle stays small.
"""

__version__ = "0.1.0"
