"""The data's files: IDX, images, Parquet, image folders, their listings, and images to score."""
