"""The on-disk formats trainers write, read without their libraries (no MPI here): safetensors shard
headers, DCP's ``.metadata`` and items, ``torch.save`` archives and their central directories, the
restricted unpickler and its opcode pre-scan, the pickle writer of the samples, and one random-access
byte view over files and ranged object reads. Formats import the core (errors, the safetensors codec,
the pieces' columns); trainers and the job import formats; formats import neither.
"""
