import signal

# Until the service serves (and handles SIGINT as a graceful stop), Ctrl-C or a supervisor's SIGINT
# ends it as SIGTERM does: no KeyboardInterrupt traceback from an import or a model load.
signal.signal(signal.SIGINT, signal.SIG_DFL)

from specmesh.core.extras import require  # noqa: E402
from specmesh.runtime.heap import keep_freed_memory  # noqa: E402
from specmesh.runtime.threads import set_thread_wait  # noqa: E402

require("torch", "python -m verifier_service")  # an install without the torch extra: say which to add
set_thread_wait(spin=True)  # before torch and llama.cpp load libgomp (specmesh/runtime/threads.py)
keep_freed_memory()  # vocabulary-wide rows every step: no page faults per step (specmesh/runtime/heap.py)

from verifier_service.server import run  # noqa: E402

run()
