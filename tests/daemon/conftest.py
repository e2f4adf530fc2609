"""Daemon-process tests share the `fleet` fixture of tests/conftest.py; the fleet
itself lives in `tests.daemon.fleet`."""
