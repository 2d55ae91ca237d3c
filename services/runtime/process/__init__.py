"""The service process itself: services started as child processes and awaited until ready
(process), TCP ports picked for a server that binds later (ports), freed buffers kept for reuse
(allocator), start-up objects kept out of full garbage collections (garbage_collection), and
background tasks whose stop always ends (tasks)."""
