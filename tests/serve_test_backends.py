"""``python tests/serve_test_backends.py ARGS``: the serve command with the test
backends of serving_backends.py registered (the server tests start it as a subprocess)."""

import sys

import serving_backends
from polyengine import register_plugin
from polyengine.serving.cli import main

register_plugin(serving_backends, "serving-test-backends")
sys.exit(main(sys.argv[1:]))
