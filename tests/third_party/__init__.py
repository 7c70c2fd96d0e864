"""Code copied into the tests from other projects, byte for byte, each folder with its license."""
