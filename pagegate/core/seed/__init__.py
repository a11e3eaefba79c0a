"""What the seed document asked for, kept apart from the core proper: its allocator interface over the real pool, and the fragmentation simulator."""
