"""fairseq-shaped inputs read here: its Hydra/YAML training configs (yaml_config)."""
