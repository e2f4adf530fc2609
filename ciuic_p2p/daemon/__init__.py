"""The node daemon: the asyncio adapters around the pure cores."""
