from gateway.server import run

run()
