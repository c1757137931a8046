"""One module per command, named after it: each reads its inputs, calls the library and writes its
outputs. Nothing outside stages/ and cli.py imports a stage.
"""
