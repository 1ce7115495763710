"""What every strategy is built from: the Strategy triple, the builder kit, the model
contract, flat views, meshes."""
