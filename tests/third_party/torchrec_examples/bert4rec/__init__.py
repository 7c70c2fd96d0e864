"""Added here (torchrec has no __init__.py in this folder) so the copied model imports as a package."""
