"""Multi-turn environments and tools: what a model talks to between its turns."""
