"""Pipelines of stages (drafter-pipeline pipeline=NAME): the main job and the served pipeline as configs."""
