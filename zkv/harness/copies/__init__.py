"""The rank's copy path on a model's cache: the rig, its benchmark beside a
plain ``copy_``, and the GPU check that runs both on a lent device."""
