"""``python -m facodegen ...``: the CLI without the console script (e.g. run from a checkout)."""

from .cli import main

main(prog_name="facodegen")
