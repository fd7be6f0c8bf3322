from drafter_service.server import run

run()
