"""Every way a version of the weights travels from the learner to the generators, behind one sending and one
receiving interface (``transports``): published folders, served folders and deltas, NCCL push, CUDA IPC."""
