"""Root fixtures. This directory is on ``sys.path`` (pytest puts a conftest's directory there), so
every test module can ``from _wait import wait_until``."""
