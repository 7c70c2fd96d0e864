"""Composable sharded modules for recommender models."""
