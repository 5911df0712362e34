"""Real text for the quality measurement: ordinary prose, a few hundred tokens each.

``CALIBRATION_TEXT`` gives the E8 codec its key means (and ``tune_tau`` its data); the
``PROMPTS`` are what quality is measured on, so nothing is calibrated on what it is judged by.
``QUESTIONS`` are short chat questions whose greedy answers, fp32 against a codec, are compared.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_TEXT", "PROMPTS", "QUESTIONS"]

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Why do leaves change colour in autumn?",
    "How many days are there in a leap year?",
    "What does a baker do in the morning?",
    "Explain in one sentence what a harbour is.",
)

CALIBRATION_TEXT = """\
The harbour town wakes before the sun does. By five o'clock the bakers have already pulled the \
first trays of bread from their ovens, and the smell drifts down the narrow streets toward the \
water, where the fishing boats are coming back in with their nets folded on the decks. The \
fishermen do not talk much at that hour. They tie up, hand their crates to the men from the \
market, and stand for a while with their hands around paper cups of coffee, watching the light \
come up over the breakwater. Later in the morning the tourists arrive on the ferry from the \
mainland, with their cameras and their maps, and the town changes its face: the cafes put out \
their chairs, the shops raise their shutters, and the old women who sell lace set up their \
tables in the square. Most visitors stay only a day. They walk up the hill to the church, buy \
a postcard, eat grilled sardines at one of the restaurants by the quay, and catch the last \
ferry home. The few who stay longer discover a different place, quieter and slower, where the \
evenings are long and the conversations in the bars go on until the lights of the boats are \
the only thing left to look at on the water.
"""

PROMPTS: tuple[str, ...] = (
    """\
When my grandmother moved out of the farmhouse she had lived in for almost sixty years, the \
family gathered for a weekend to help her sort through what she wanted to keep. It was harder \
than any of us expected. Every drawer held something that started a story: a ribbon from a \
county fair in a year nobody could remember, a bundle of letters from a cousin who had \
emigrated to Canada, a tin of buttons that she insisted were worth saving because you never \
know when you will need a button. My uncle wanted to be efficient about it. He brought a stack \
of cardboard boxes and a roll of tape and a marker, and he labelled the boxes keep, give away \
and throw out before anyone had opened a single cupboard. By the end of the first afternoon \
the keep box was overflowing and the other two were almost empty, and he had stopped trying \
to hurry anybody. We ate dinner at the long kitchen table for what we all understood was the \
last time. Somebody found an old photograph of the same table, taken at a harvest supper when \
my mother was a little girl, and we passed it around and tried to name everyone in it. My \
grandmother knew them all. She told us who had married whom, who had moved to the city, who \
had been the best dancer in the valley and who had fallen off the hay wagon and broken an arm \
the summer the photograph was taken. Later, when the dishes were done, she walked out onto \
the porch and stood looking at the fields for a long time. I went out to stand with her. She \
said that the hardest part was not leaving the house but leaving the view, because she had \
watched those fields change colour with every season of her adult life, and she did not know \
what she would look at now. Then she laughed and said that at least the new apartment had a \
window facing the park, and that she intended to learn the names of every dog that walked \
past it. The next morning we loaded the car, and she did not look back as we drove away, \
although I saw her hand tighten on the strap of her bag when we passed the mailbox at the end \
of the lane. She has lived in the apartment for three years now. She knows the dogs.
""",
    """\
The public library in our neighbourhood is a plain brick building that most people walk past \
without noticing, but on a weekday afternoon it is one of the busiest places in the city. \
Students come after school to do their homework at the long tables, because the library is \
quiet and warm and has reliable internet, which many of them do not have at home. Retired \
people read the newspapers in the armchairs by the window, and some of them have been sitting \
in the same chairs at the same hour for so many years that the staff greet them by name. \
Parents bring small children to the story hour on Tuesdays and Thursdays, where a librarian \
with a remarkable range of voices reads picture books to a circle of toddlers who are only \
sometimes paying attention. There are people looking for jobs, filling in applications on the \
public computers and asking for help with their resumes. There are people who have nowhere \
else to go during the day, and the library lets them stay, as long as they follow the same \
rules as everyone else. The librarians do much more than lend books. They help people fill in \
tax forms, find information about housing and health care, learn to use email, and track \
down obscure facts for curious patrons who have been arguing about something with a friend. \
One of them told me that the most common question she hears is not about books at all but \
about how to print a document from a phone. Another said that the part of the job she finds \
most rewarding is watching a child who arrived at the library unable to read come back a year \
later to borrow chapter books on her own. Funding for the library has been cut several times \
over the past decade, and the opening hours are shorter than they used to be. Every few years \
there is a proposal to close it and move its services online, and every time the \
neighbourhood turns out to the council meeting to object. The people who speak at those \
meetings rarely talk about books. They talk about a place where anyone can go, for free, \
without being asked to buy anything or explain why they are there.
""",
    """\
Learning to cook as an adult is a humbling experience. I grew up in a household where meals \
simply appeared, and by the time I left home I could make toast, boil pasta and not much \
else. For years I lived on sandwiches, takeaway and whatever was on offer in the office \
canteen. What finally changed my habits was not a New Year's resolution but a broken leg. \
Stuck at home for six weeks, bored and tired of delivery food, I started watching cooking \
videos and then, cautiously, trying the simplest recipes. The first few attempts were not \
good. I burned the onions because I did not understand that the heat needed to be lower, \
and I added salt at the end instead of throughout, so everything tasted flat. A friend who \
cooks well came round one evening and watched me chop a carrot, and then very gently took the \
knife out of my hand and showed me how to hold it. That small lesson made more difference \
than any recipe. Once I could chop quickly and safely, cooking stopped feeling like a chore \
and started to feel like something closer to a craft. I learned to taste as I went, to \
trust my nose, and to keep a few basic ingredients in the cupboard so that I could put \
together a meal without a special trip to the shop. I learned that most dishes are built on \
a small number of techniques, and that once you understand how to brown meat, soften \
vegetables and make a simple sauce, you can cook a surprising variety of things. My leg \
healed long ago, but I still cook most evenings. It has become the part of the day when I \
put my phone away and think about nothing except what is in front of me. There is a real \
pleasure in turning a bag of groceries into a meal, and an even greater one in feeding other \
people. I have started inviting friends round on Sundays, and although the food is not always \
a success, nobody has complained yet. Last month I made bread for the first time. It was \
dense and slightly lopsided, and I have never been prouder of anything I have made.
""",
)
