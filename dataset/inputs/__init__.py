"""The images a trained model scores (`flows.predict`, `flows.score`): a folder of Parquet, IDX or image files read as one table."""
