"""The ``switchyard`` command line: ``main`` builds the parser; each command group lives in its own module."""
