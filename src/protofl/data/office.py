"""Office-Caltech-10 (``office_caltech10``) and Office-Home (``office_home``) from image folders.

Neither benchmark ships an official train/test split: the default protocol is ``vpdr`` (random
80/20 under seed 10, as VPDR's loader falls back to); ``feddap`` is FedDAP's / RethinkFL's
``i % 10 <= 7`` rule over the domain's ImageFolder order. A domain that has ``train/`` and
``test/`` subfolders uses them (``official``), as VPDR's loader does.
"""

from __future__ import annotations

from protofl.data.imagefolder import FolderBenchmark

OFFICE_CALTECH10_ENV = "PROTOFL_OFFICE_CALTECH10_ROOT"
OFFICE_HOME_ENV = "PROTOFL_OFFICE_HOME_ROOT"

OFFICE_CALTECH10_CLASSES: tuple[str, ...] = (
    "back_pack",
    "bike",
    "calculator",
    "headphones",
    "keyboard",
    "laptop_computer",
    "monitor",
    "mouse",
    "mug",
    "projector",
)
"""Label order: the folder names sorted (torchvision ImageFolder order)."""

OFFICE_CALTECH10_DOMAINS: tuple[str, ...] = ("amazon", "caltech", "dslr", "webcam")

OFFICE_CALTECH10_LAYOUT = """\
<root>/                        (or <root>/Office_Caltech_10/ or <root>/Office-Caltech-10/)
  amazon/
    back_pack/  *.jpg
    bike/       *.jpg
    ...         (10 class folders: back_pack bike calculator headphones keyboard
                 laptop_computer monitor mouse mug projector)
  caltech/  ...
  dslr/     ...              (Office-31's extra images/ level is accepted: dslr/images/<class>/)
  webcam/   ...
"""

OFFICE_CALTECH10 = FolderBenchmark(
    name="office_caltech10",
    classes=OFFICE_CALTECH10_CLASSES,
    domains=OFFICE_CALTECH10_DOMAINS,
    domain_folders={
        "amazon": ("amazon",),
        "caltech": ("caltech", "caltech10", "caltech256"),
        "dslr": ("dslr",),
        "webcam": ("webcam",),
    },
    env=OFFICE_CALTECH10_ENV,
    layout=OFFICE_CALTECH10_LAYOUT,
    distributed=(
        "Office-Caltech-10 (Gong et al., CVPR 2012): the 10 classes shared by Office-31 and "
        "Caltech-256, e.g. the Office_Caltech_10 folder used by RethinkFL/FedDAP or the archive "
        "listed at github.com/jindongwang/transferlearning (data/ section)"
    ),
    description="Office-Caltech-10: 4 domains (amazon, caltech, dslr, webcam), 10 classes",
    source="real: Office-Caltech-10 image folders",
    containers=("Office_Caltech_10", "Office-Caltech-10", "office_caltech_10", "OfficeCaltech10"),
)

OFFICE_HOME_CLASSES: tuple[str, ...] = tuple(
    sorted(
        (
            "Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket",
            "Calculator", "Calendar", "Candles", "Chair", "Clipboards", "Computer", "Couch",
            "Curtains", "Desk_Lamp", "Drill", "Eraser", "Exit_Sign", "Fan", "File_Cabinet",
            "Flipflops", "Flowers", "Folder", "Fork", "Glasses", "Hammer", "Helmet", "Kettle",
            "Keyboard", "Knives", "Lamp_Shade", "Laptop", "Marker", "Monitor", "Mop", "Mouse",
            "Mug", "Notebook", "Oven", "Pan", "Paper_Clip", "Pen", "Pencil", "Postit_Notes",
            "Printer", "Push_Pin", "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver",
            "Shelf", "Sink", "Sneakers", "Soda", "Speaker", "Spoon", "TV", "Table", "Telephone",
            "ToothBrush", "Toys", "Trash_Can", "Webcam",
        )
    )
)  # fmt: skip
"""Label order: the 65 folder names sorted as Python sorts them (ImageFolder order: TV before
Table). Folders match case-insensitively."""

OFFICE_HOME_DOMAINS: tuple[str, ...] = ("art", "clipart", "product", "real_world")

OFFICE_HOME_LAYOUT = """\
<root>/                        (or <root>/OfficeHomeDataset_10072016/)
  Art/
    Alarm_Clock/  *.jpg
    ...           (65 class folders)
  Clipart/  ...
  Product/  ...
  Real World/ ...              (also RealWorld/ or Real_World/)
"""

OFFICE_HOME = FolderBenchmark(
    name="office_home",
    classes=OFFICE_HOME_CLASSES,
    domains=OFFICE_HOME_DOMAINS,
    domain_folders={
        "art": ("Art",),
        "clipart": ("Clipart",),
        "product": ("Product",),
        "real_world": ("Real World", "RealWorld", "Real_World", "real"),
    },
    env=OFFICE_HOME_ENV,
    layout=OFFICE_HOME_LAYOUT,
    distributed=(
        "Office-Home (Venkateswara et al., CVPR 2017): "
        "https://www.hemanthdv.org/officeHomeDataset.html (OfficeHomeDataset_10072016.zip)"
    ),
    description="Office-Home: 4 domains (art, clipart, product, real_world), 65 classes",
    source="real: Office-Home image folders",
    containers=("OfficeHomeDataset_10072016", "OfficeHome", "Office-Home", "office_home"),
)

OFFICE_CALTECH10.register()
OFFICE_HOME.register()

load_office_caltech10 = OFFICE_CALTECH10.load
load_office_home = OFFICE_HOME.load

__all__ = [
    "OFFICE_CALTECH10",
    "OFFICE_CALTECH10_CLASSES",
    "OFFICE_CALTECH10_DOMAINS",
    "OFFICE_CALTECH10_ENV",
    "OFFICE_HOME",
    "OFFICE_HOME_CLASSES",
    "OFFICE_HOME_DOMAINS",
    "OFFICE_HOME_ENV",
    "load_office_caltech10",
    "load_office_home",
]
