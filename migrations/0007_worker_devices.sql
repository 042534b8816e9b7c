-- Workers announce the devices they own, so that a job larger than any worker is refused at creation.
CREATE TABLE workers (
    id text PRIMARY KEY,
    devices integer NOT NULL CHECK (devices > 0),
    device_kind text NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now()
);
