"""What outlives a process: the stage checkpoint store and its checked byte stream."""
