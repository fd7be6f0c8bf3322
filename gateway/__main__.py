import signal

# Until the service serves (and handles SIGINT as a graceful stop), Ctrl-C or a supervisor's SIGINT
# ends it as SIGTERM does: no KeyboardInterrupt traceback from an import or a model load.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from gateway.server import run  # noqa: E402

run()
