"""Transports: move frames between authenticated peers.

``base`` defines the interface the cores above use; ``quic`` implements it over
aioquic with our own admission checks; ``memory`` implements it in memory for tests.
"""
