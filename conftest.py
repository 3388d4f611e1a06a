# The difftest pytest plugin is registered through the package's pytest11 entry point;
# nothing else is needed at the top level. Tests share engine runs through fixtures in
# tests/conftest.py.
