"""The seam between a server and its engine, both halves in one room: the engine-core process (`core_process`),
its loop (`core_loop`) and the frames it speaks (`frames`); the gateway's client of one core (`core_client`), of
several (`replicas`), the Protocol both meet (`engine_client`); and the public asyncio face for library use, a
client of core processes as the gateway is (`async_engine`). Nothing here imports the gateway; importing the
clients imports no torch."""
