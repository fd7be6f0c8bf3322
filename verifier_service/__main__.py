from specmesh.core.extras import require
from specmesh.runtime.threads import set_thread_wait

require("torch", "python -m verifier_service")  # an install without the torch extra: say which to add
set_thread_wait(spin=True)  # before torch and llama.cpp load libgomp (specmesh/runtime/threads.py)

from verifier_service.server import run  # noqa: E402

run()
